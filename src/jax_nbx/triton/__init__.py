"""The CUDA path's Triton kernels (`kernels`), their launch program (`plan`),
ahead-of-time compilation (`compile`) and the interpreter runner used by the
tests (`interpret`).  Importing this package does not import Triton."""

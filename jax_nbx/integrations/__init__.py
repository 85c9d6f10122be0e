"""jax_nbx inside other libraries' models: `keras_hub` (keras-hub's MoE
models through the fused op: `patch_moe`, `unpatch_moe`).  Each submodule
imports its library when it is used; none is imported here."""

// The test switch NBX_BREAK_OPTIONAL (cmake/optional_backend.cmake): included first into the
// sources of the optional backends it names (-DNBX_BREAK_OPTIONAL=cuda), so that they fail to
// compile and the build's fallback can be tested.  Never part of a product build.
#error "NBX_BREAK_OPTIONAL: this optional backend is broken on purpose (a test of the build's fallback)"

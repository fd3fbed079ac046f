"""tformer's own CPU kernels: C sources built at install time and loaded with ctypes (gemv)."""

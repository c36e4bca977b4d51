"""Device kernels. Nothing here imports torch but each arch's launch.py, the host side that turns
a spec and torch tensors into a compiled kernel and its arguments."""

"""Device kernels. Nothing here imports torch: launchers hand kernels cute tensors."""

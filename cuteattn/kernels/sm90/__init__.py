"""Hopper (sm_90a) kernels: TMA loads, wgmma GEMMs, warp specialization."""

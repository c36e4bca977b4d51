set -u
t0=$(date +%s); el(){ echo "=== $(( $(date +%s) - t0 ))s: $*"; }
el tests-bwd; timeout 170 python3 benchmarks/dev_gpu_tests.py 15 tests/test_gpu_bwd.py -k "d64 or determin" 2>&1 | tail -25
el tests-packed; timeout 100 python3 benchmarks/dev_gpu_tests.py 15 tests/test_gpu_sparse.py tests/test_gpu_mods.py -k "packed_sequences_backward or packed_sequences_with_mods_gradients" 2>&1 | tail -15
el tests-d80; timeout 150 python3 benchmarks/dev_gpu_tests.py 15 tests/test_gpu_surface.py tests/test_gpu_fwd.py tests/test_gpu_fp8.py -k "80 or 72 or paged_prefill_with_a_learnable_sink" 2>&1 | tail -25
el ab-d64; timeout 120 python3 benchmarks/dev_bwd_ab.py D64_TILE_M 64 128 --d 64 --rounds 2 2>&1 | tail -9
el ab-dq; timeout 120 python3 benchmarks/dev_bwd_ab.py DQ_GROUPS 1 4 --deterministic --d 64,128 --rounds 2 2>&1 | tail -15
el done

"""MoE routing: prediction of the next layers' experts (predict), routing traces (trace) and
cache-policy simulation over them (cachesim)."""

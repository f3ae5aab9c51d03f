"""Where bytes live: budget detection (budget), the memory plan (plan), the expert slot pool
and its reader threads (pool: an expert source, backends/experts.py), and the memory guard
(guard). Installed as `onebit.memory`; see docs/DESIGN.md.
"""

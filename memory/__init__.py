"""Where bytes live: budget detection, the memory plan, the expert slot pool (see docs/DESIGN.md).

Installed as `onebit.memory`. Its modules arrive with the memory-plan issue.
"""

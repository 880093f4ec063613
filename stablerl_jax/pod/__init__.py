"""What a step costs on a TPU pod, read from programs compiled here for its topology.

    aot.py              topology names, abstract steps, `.lower().compile()` for a pod
    hlo_loops.py        loops and collectives of an optimized HLO module
    sampler_programs.py the sampler's rows per pass and their bytes; its decode-step programs
    roofline.py         time estimates from the compiled programs (compiler and roofline)
    sampler_schedules.py response lengths and the sampler's schedules, simulated (numpy)
    schedule_prices.py  those schedules priced: length-aware sample-step estimates
    libtpu_env.py       libtpu on a host without a TPU, started quietly
"""

"""The harness that tests/, bench/, scripts/ and launch/ share (nothing outside tests/ imports
a module of tests/):

    distributed.py   `run_distributed(fn, world_size, ...)`: gloo ranks on 127.0.0.1
    records.py       `make_records`, `grpo_records`: seeded per-sample records for the tiny models
    inprocess.py     the trainer in-process as train.py builds it (`compose`, `trainer`, `SMALL`)
                     and the rank bodies the trainer tests launch
    host_syncs.py    `count_host_syncs`: the syncs a piece of code would make on a GPU, from a CPU run
    mixed_devices.py `MixedDevices`: ops whose tensors sit on two devices, seen on CPU
"""

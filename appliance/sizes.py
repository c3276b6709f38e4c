"""The binary units the appliance counts memory in: one home, so that a GiB is the same size
in the config, the memory gate and the plan."""

MIB = 1024**2
GIB = 1024**3

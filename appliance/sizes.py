"""The sizes the appliance counts memory in (MiB, GiB: powers of two): one home, so that a GiB
is the same in the config, the GPU-memory guard and the plan."""

MIB = 1024**2
GIB = 1024**3

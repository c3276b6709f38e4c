"""Several people, one card: each request's key says whose it is (appliance.people), and the door
keeps each key to its limits (`limits`) and counts what it used from the runtime's own answers
(`meter`, into appliance.usage).

May import: the core modules and appliance.proxy's own (checks, asgi)."""

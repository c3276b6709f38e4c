"""Several people, one card: each request's key says whose it is (appliance.people), and the door
keeps each key to its limits (`limits`), gives the keys fair turns at a full runtime (`turns`,
`fair`), counts what each used from the runtime's own answers (`meter`, into appliance.usage),
and keeps their keys off the network in clear (`tls`).

May import: the core modules and appliance.proxy's own (checks, asgi)."""

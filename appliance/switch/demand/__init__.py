"""Switch on demand (`[switching] on_demand`): a request for a model whose runtime does not serve
waits at the proxy, and its runtime is switched in through the same switch as `b70ctl switch`.
`policy` decides which runtime a card serves next, as a pure function of what was observed.

May import: what appliance.switch may.
"""

"""What each engine is, in one place: one module per engine (`vllm`, `llamacpp`) answers what the
rest of the appliance asks of it, and `of(engine)` finds that module's answers. Today they say
which caches the engine compiles into and by which variables, and by which of its start-up lines
a start shows that it compiled or that it loaded what an earlier start compiled. `lasting` keeps
those caches across stops: one folder per runtime and recipe, and the checks a start makes of it.

Knows engines and files; decides nothing about units, switches or the proxy. May import: the
core modules (appliance.errors, files, layout) and `config`.
"""

from __future__ import annotations

from appliance.config import Engine
from appliance.engines import llamacpp, vllm
from appliance.engines.facts import CacheVariable, EngineFacts, StartCache

__all__ = ["CacheVariable", "EngineFacts", "StartCache", "of"]

_FACTS = {Engine.VLLM: vllm.FACTS, Engine.LLAMACPP: llamacpp.FACTS}


def of(engine: Engine) -> EngineFacts:
    """What `engine` is: its caches and how its start-up lines read."""
    return _FACTS[engine]

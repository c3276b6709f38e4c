"""The front door on :8000, inside LiteLLM's proxy process: the request checks and the key
(`door`, `checks`), the hold during a switch (`waiting`, `hook`), the fast way to the runtime
(`direct`) and the resend of a request whose runtime died before its first byte (`relay`), LiteLLM's
routing across runtimes and peers (`routing`), how all of it is mounted in front of LiteLLM's
app (`mount`), and the APIs beside chat and completions: Responses, Anthropic Messages,
embeddings, rerank, tokenize (`apis`).

May import: the core modules alone (appliance.hold above all: the hold mark a switch writes and
the counts the proxy writes back). Nothing outside this package imports it: LiteLLM loads it by
name from the rendered config.
"""

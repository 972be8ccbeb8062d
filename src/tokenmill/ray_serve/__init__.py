"""Scale out on Ray Serve (``pip install 'tokenmill[ray]'``; ``tokenmill serve --ray``).

Every replica runs the same FastAPI app and engine as ``tokenmill serve``; Ray Serve's
proxy streams the SSE. Replicas report their token load (``load``), which drives the
autoscaling policy (``policy``) and the request router (``router``). Only ``replica``,
``router`` and ``launch`` import Ray.
"""

"""The cluster's router: the engine-client facade (``router.py``) over worker membership
(``membership.py``), each request's phases (``phases.py``, ``request.py``, ``outputs.py``) and
its sockets and IO thread (``io.py``); ``config.py`` holds its typed configuration."""

from engine.cluster.router.config import ClusterUnavailableError, RouterConfig
from engine.cluster.router.router import Router

__all__ = ["ClusterUnavailableError", "Router", "RouterConfig"]

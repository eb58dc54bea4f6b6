"""The two Serve controller calls the coordinator needs to resize the pools.

Ray 2.60 has no public Python API for either: setting a deployment's replica count
from outside is what the dashboard's `POST /api/v1/applications/{app}/deployments/
{deployment}/scale` does (`ServeController.update_deployment_replicas`, allowed only
for applications deployed with `external_scaler_enabled: true`), and replica states
are what `serve status` / `GET /api/serve/applications/` show
(`ServeController.get_deployment_details`). Both go to the controller actor here, in
one place, so a Ray upgrade changes only this module.
"""

from __future__ import annotations

import asyncio
import functools

import ray
from ray import serve
from ray.serve._private.common import DeploymentID
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

__all__ = ["app_deleting", "replica_states", "set_num_replicas", "target_replicas"]


@functools.cache
def _controller() -> ray.actor.ActorHandle:
    """The Serve controller's handle, looked up once per process: the coordinator polls
    replica states twice a second, and `ray.get_actor` is a blocking GCS round trip.
    The controller restarts under the same handle (Serve sets `max_restarts=-1`)."""
    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


async def set_num_replicas(app: str, deployment: str, num_replicas: int) -> None:
    """Ask Serve for `num_replicas` replicas of `deployment` in `app`; Serve starts or
    gracefully stops replicas asynchronously.

    Raises:
        ExternalScalerDisabledError: `app` was deployed without `external_scaler_enabled`.
    """
    await _controller().update_deployment_replicas.remote(DeploymentID(name=deployment, app_name=app), num_replicas)


async def replica_states(app: str, deployment: str) -> dict[str, str]:
    """Serve's state (`STARTING`, `RUNNING`, `STOPPING`, ...) of every replica of
    `deployment` in `app`, by replica id (`ReplicaContext.replica_id.unique_id`)."""
    details = await _controller().get_deployment_details.remote(app, deployment)
    return {replica.replica_id: replica.state.value for replica in details.replicas}


async def target_replicas(app: str, deployment: str) -> int:
    """The replica count Serve keeps `deployment` of `app` at (what the last
    `set_num_replicas`, or the deployment's `num_replicas`, asked for)."""
    details = await _controller().get_deployment_details.remote(app, deployment)
    return details.target_num_replicas


async def app_deleting(app: str) -> bool:
    """Whether `app` is being deleted (or gone): its replicas are all stopping, the
    coordinator included, so a stopping member must not wait for it."""
    status = await asyncio.to_thread(serve.status)
    application = status.applications.get(app)
    return application is None or application.status == "DELETING"

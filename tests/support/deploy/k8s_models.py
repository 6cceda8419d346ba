"""Parse manifest objects into the Kubernetes Python client's models.

`ApiClient.deserialize` is the client's own path from API JSON to models: it
checks types and required fields, and drops fields it does not know. So an
object must both deserialize and serialize back to exactly what was written;
a misspelt or misplaced field shows up as a difference.
"""

from __future__ import annotations

import inspect
import json

from kubernetes import client


class _Response:
    """What older clients' `deserialize(response, type)` read: `.data`."""

    def __init__(self, data: str):
        self.data = data


def model_name(obj: dict) -> str:
    """`apps/v1` + `DaemonSet` -> `V1DaemonSet`."""
    version = obj["apiVersion"].rsplit("/", 1)[-1]
    return version[0].upper() + version[1:] + obj["kind"]


def deserialize(obj: dict):
    """The client model for a manifest object (ValueError/TypeError if invalid)."""
    api = client.ApiClient()
    name = model_name(obj)
    if not hasattr(client, name):
        raise TypeError(f"the kubernetes client has no model {name} for "
                        f"{obj['apiVersion']} {obj['kind']}")
    text = json.dumps(obj)
    params = list(inspect.signature(api.deserialize).parameters)
    if params[0] == "response_text":       # kubernetes >= 35
        return api.deserialize(text, name, "application/json")
    return api.deserialize(_Response(text), name)


def round_trip(obj: dict) -> dict:
    """The object as the client would send it after parsing it."""
    return client.ApiClient().sanitize_for_serialization(deserialize(obj))

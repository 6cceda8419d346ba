"""Which connections a NetworkPolicy admits, as the API reference defines it:
enough to check ours (label selectors, pod and namespace peers, ports)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Peer:
    """A pod that opens a connection: its labels, namespace and that namespace's labels."""

    labels: dict = field(default_factory=dict)
    namespace: str = "default"
    namespace_labels: dict = field(default_factory=dict)


def selects(selector: dict | None, labels: dict) -> bool:
    """Whether a LabelSelector matches `labels` ({} matches everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _peer_matches(rule_peer: dict, peer: Peer, policy_namespace: str) -> bool:
    if "ipBlock" in rule_peer:
        return False                      # addresses, not pods: none of ours
    ns_sel, pod_sel = rule_peer.get("namespaceSelector"), rule_peer.get("podSelector")
    if ns_sel is None:                    # pods of the policy's own namespace
        return peer.namespace == policy_namespace and selects(pod_sel, peer.labels)
    return selects(ns_sel, peer.namespace_labels) and selects(pod_sel, peer.labels)


def admits(policy: dict, target_labels: dict, peer: Peer, port: int,
           protocol: str = "TCP") -> bool | None:
    """Whether `policy` admits `peer` to `port` of a pod with `target_labels`;
    None if the policy does not govern that pod's ingress at all."""
    spec = policy["spec"]
    if not selects(spec["podSelector"], target_labels) or "Ingress" not in spec["policyTypes"]:
        return None
    ns = policy["metadata"]["namespace"]
    for rule in spec.get("ingress", []):
        ports = rule.get("ports")
        if ports and not any(p.get("protocol", "TCP") == protocol and p.get("port") == port
                             for p in ports):
            continue
        peers = rule.get("from")
        if not peers or any(_peer_matches(p, peer, ns) for p in peers):
            return True
    return False

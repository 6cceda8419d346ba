"""Deployment tests: systemd units (bare metal) and Kubernetes manifests."""

"""Fixtures shared by every test package (real daemon, real S3 server, ...)."""

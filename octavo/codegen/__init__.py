"""Codegen: per-backend kernels for the octavo op set, and the artifact writer."""

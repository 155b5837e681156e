"""Fake of reForge's modules_forge/forge_version.py (Forge Classic's says "classic")."""

version = "1.0.0v2-v1.10.1RC"

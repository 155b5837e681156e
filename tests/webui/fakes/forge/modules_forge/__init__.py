"""Fake marker of Forge\x27s modules_forge package."""

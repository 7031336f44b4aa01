"""A keyword task as an installable plug-in package (entry points in its pyproject.toml)."""

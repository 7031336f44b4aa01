"""The base of every config section: unknown keys are errors, each field documents itself."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section. Field descriptions are the docstring under each field."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        frozen=False,
    )


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key and where it was set."""

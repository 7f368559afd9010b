"""Why packcheck could not give a cell its model: each error names whose limit it is (packcheck's shrink, the
library's own config, the checkpoint's weights). The runner files them as error / unsupported cells."""

from __future__ import annotations


class ShrinkError(RuntimeError):
    """packcheck could not make a tiny model of this config (a limit of packcheck, not of the model)."""


class TextPathError(ShrinkError):
    """A multimodal model's own generate() gives position_ids packcheck cannot lay a packed text row out from (a
    limit of packcheck, as :class:`ShrinkError`)."""


class LibraryConfigError(RuntimeError):
    """The model's own config does not build in transformers, shrunk or not (the library's, not packcheck's).
    ``cause``: ``library_config``, or ``crash`` where the library's own model code fails whatever its config
    (:func:`~.twin.own_module_attribute_missing`)."""

    def __init__(self, message: str, cause: str = "library_config") -> None:
        super().__init__(message)
        self.cause = cause


class OverrideConfigError(RuntimeError):
    """The config with the spec's overrides does not build in transformers while the config without them does (the
    user's override broke it: neither the library's nor packcheck's)."""


class WeightsError(RuntimeError):
    """``--packcheck-weights=pretrained`` loaded no tensor of the model: another model's weights, refused on purpose (every
    cell of it is an error with cause ``weights_mismatch``, never ``packcheck_error``). ``cause``: ``weights_mismatch``,
    or ``weights_unreadable`` where the weights file itself cannot be read (corrupt, truncated, not a checkpoint)."""

    def __init__(self, message: str, cause: str = "weights_mismatch") -> None:
        super().__init__(message)
        self.cause = cause

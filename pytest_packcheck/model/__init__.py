"""Models: from a model spec to the built model a cell runs on, one module per stage (data flows top to bottom).

- :mod:`.specs`: a model spec (``org/name[@rev]``, a local folder, ``arch:<model_type>``, ``{key=value}``
  overrides) parsed into a :class:`~.specs.ModelSpec`;
- :mod:`.architectures`: which model types packcheck runs, through which transformers class;
- :mod:`.configs`: reading ``config.json`` (Hub / local), default configs with their layer variants, overrides;
- :mod:`.resolve`: spec -> :class:`~.resolve.ResolvedModel` (config, class, revision), ``config.json`` only;
- :mod:`.tiny`, :mod:`.shrink`: the tiny sizes, and the config shrunk to them keeping every attention feature;
- :mod:`.multimodal`: the text path of M-RoPE multimodal models (rotary sections, position_ids layout);
- :mod:`.twin`: the unshrunk config on the meta device, to tell the config's own faults from the shrink's;
- :mod:`.build`: the model of one cell group (random or pretrained weights, the backend registered);
- :mod:`.batches`: example lengths -> packed, padded and solo batches (transformers' own collator);
- :mod:`.build_errors`: why a cell got no model (the shrink's limit, the library's config, the weights).

Importing this package imports neither torch nor transformers; the modules import them inside functions.
"""

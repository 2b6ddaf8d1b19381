"""nn building blocks: rotary position embeddings (``flashtile.layers.rotary``)."""

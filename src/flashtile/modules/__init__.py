"""nn modules built on flashtile's attention: ``mha.MHA``, ``mlp.Mlp`` / ``mlp.GatedMlp``, ``block.Block``."""

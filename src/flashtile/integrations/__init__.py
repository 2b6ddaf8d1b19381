"""Integrations with other libraries; ``flashtile.integrations.hf`` registers flashtile with transformers."""

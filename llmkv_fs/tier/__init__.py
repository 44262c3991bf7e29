"""The thin vLLM adapter: ``FsTier`` (a ``SecondaryTierManager`` over the
engine), the plugin that registers it, its metrics and the hashing identity.
The harness that drives it (demo, bench, driver) lives in ``llmkv_fs.harness``."""

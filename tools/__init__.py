"""Development tools that are not runtime code: seeded tiny checkpoints (`tandem make-model`),
their corpus training, and the embedded corpus. No serving process imports this package; the
demo, the benchmarks, `tandem profile` and the tests do (layering: tools/README.md)."""

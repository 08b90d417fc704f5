"""The Core ML (Neural Engine) draft backend: the package host (package_host.py, coreml_draft.py) and the
package metadata shared with the builder (package_format.py). The drafts and their host are
mirror_mlx.drafts; the Speculative-Streaming draft's training is mirror_mlx.train.ss_draft.

Installed as `mirror_mlx.ane_draft`."""

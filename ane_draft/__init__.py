"""The Core ML (Neural Engine) draft backend: the package host (package_host.py, coreml_draft.py), the
package metadata shared with the builder (package_format.py), and the Speculative-Streaming draft's
training (train.py). The drafts and their host are mirror_mlx.drafts.

Installed as `mirror_mlx.ane_draft`."""

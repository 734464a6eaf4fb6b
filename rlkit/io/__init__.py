"""On-disk formats and their safe handling: Arrow table schemas and manifests, claiming and atomically
writing --out, model directories and their verification, shards, --follow step directories, data
sources and metrics logs. No RL math here; torch only where a checkpoint is loaded.
"""

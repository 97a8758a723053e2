"""Integrations with training frameworks: each module imports its framework only when used.

    gdswriter.integrations.lightning      GDSCheckpointIO, a PyTorch Lightning CheckpointIO plug-in
    gdswriter.integrations.transformers   GDSCheckpointing / GDSTrainer for the Hugging Face Trainer
    gdswriter.integrations.deepspeed      use_gdswriter / GDSCheckpointEngine, a DeepSpeed checkpoint engine
    gdswriter.integrations.megatron       GDSSaveShardedStrategy / GDSLoadShardedStrategy, Megatron-Core's
                                          dist_checkpointing strategies (on the DCP plug-in)
    gdswriter.integrations.torchtitan     GDSCheckpointManager, torchtitan's CheckpointManager on gdswriter
    gdswriter.integrations.engines        the I/O engines both keep across saves
"""

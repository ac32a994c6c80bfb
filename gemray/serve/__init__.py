"""Using a trained model: evaluate a checkpoint, recommend items for users, export a serving artifact.

    load_trained(checkpoint, config=..., device=...) -> TrainedModel     gemray.serve.model
    run_config(checkpoint, config=..., overrides=...) -> JobConfig       the run's config, no checkpoint read
    evaluate(trained, split, ks=..., prepared_dir=...) -> dict           gemray.serve.evaluate
    recommend(trained, user_ids, k=...) -> list of (user, rank, item, score)   gemray.serve.recommend
    export(trained, out_dir)                                             gemray.serve.export

One process, no Ray cluster (the checkpoint is DCP-loaded into a one-rank TorchRec model). The exported
artifact loads with plain PyTorch (``torch.export.load``), without gemray, TorchRec or Ray.
"""

from gemray.serve.model import TrainedModel, load_trained, locate_checkpoint, run_config

__all__ = ["TrainedModel", "load_trained", "locate_checkpoint", "run_config"]

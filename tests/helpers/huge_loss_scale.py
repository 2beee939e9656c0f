"""The trainer program with fp16's first loss scale at 2^INGRAPH_LOSS_SCALE_POWER (DeepSpeed's config key
initial_scale_power): large enough and the first steps' scaled gradients overflow, as a real run's may.

    run_trainer(spec, patch="huge_loss_scale", env={"INGRAPH_LOSS_SCALE_POWER": "40"})    (conftest)
"""
import os


def install():
    from ingraph_trainer.trainer.parallel import plain_engine
    power = int(os.environ["INGRAPH_LOSS_SCALE_POWER"])
    engine_init = plain_engine.PlainEngine.__init__

    def init(self, module, optimizer, scheduler, config):
        config = {**config, "fp16": {**config.get("fp16", {}), "initial_scale_power": power}}
        engine_init(self, module, optimizer, scheduler, config)
    plain_engine.PlainEngine.__init__ = init

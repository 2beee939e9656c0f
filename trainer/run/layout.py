"""Names of the files in a run directory (shared by the trainer, the node and the HTTP routes)."""
SPEC_FILE = "run.toml"  # the run spec as given; never rewritten
MANIFEST_FILE = "dataset.json"
EVENTS_FILE = "events.jsonl"
LOG_FILE = "trainer.log"  # everything the trainer's processes print
PID_FILE = "trainer.pid"
OWNER_FILE = "owner.json"  # which graph node started the run (for the UI panel after a reload)
STOP_FILE = "STOP"  # created to ask for a checkpoint and a clean end
CHECKPOINTS_DIR = "checkpoints"
DATA_FOLDER = "ingraph_data"  # the pack's folder in ComfyUI's base directory: cache, model copies, secret
DATA_DIR_ENV = "INGRAPH_DATA_DIR"  # the operator's other place for it
COMPLETE_MARK = "COMPLETE"  # a checkpoint folder's signed list of its files, written last
SAMPLES_DIR = "samples"  # preview images of a run
MEMORY_CHOICE_FILE = "memory_choice.json"  # the checkpointing and block swap a run began with (signed): its resumes keep them

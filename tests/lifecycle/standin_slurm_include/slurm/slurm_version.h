#define SLURM_VERSION_NUMBER 0x180b00 /* 24.11.0: the pretend node's Slurm */

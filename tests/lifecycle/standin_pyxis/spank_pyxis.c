/* Stand-in for NVIDIA pyxis's SPANK plugin (tests/lifecycle, tests/slurm): it registers the
 * option srun --help shows when pyxis is loaded, --container-image, and runs no container.
 * Built against <slurm/spank.h> of the node it is installed on, as pyxis is. */
#include <slurm/spank.h>

SPANK_PLUGIN(pyxis, 1)

static int remember(int val, const char *optarg, int remote) {
    (void)val;
    (void)optarg;
    (void)remote;
    return 0;
}

/* Slurm loads a SPANK plugin only if it exports at least one slurm_spank_* callback. */
int slurm_spank_init(spank_t sp, int ac, char **av) {
    (void)sp;
    (void)ac;
    (void)av;
    return 0;
}

struct spank_option spank_options[] = {
    {"container-image", "[USER@][REGISTRY#]IMAGE[:TAG]|PATH", "[pyxis stand-in] the image to run the job in", 1, 0,
     remember},
    SPANK_OPTIONS_TABLE_END,
};

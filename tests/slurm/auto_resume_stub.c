/* Test stand-in for SageMaker HyperPod's Slurm SPANK plugin, which is what gives srun its
 * --auto-resume option on a HyperPod cluster. Debian's srun rejects the option without it.
 * This stub registers the same option (`srun --auto-resume=N`) and, in every task it
 * reaches, appends "<job id> auto-resume=<N>" to the file named by its plugstack argument,
 * so a test can see that the job script passed the flag and srun accepted and forwarded it.
 * It does none of HyperPod's node replacement. The few declarations below are those of
 * <slurm/spank.h> (Slurm 22.05), written out so that no -dev package is needed. */
#include <stdio.h>
#include <string.h>

typedef struct spank_handle *spank_t;
typedef int (*spank_opt_cb_f)(int val, const char *optarg, int remote);
struct spank_option {
    char *name;
    char *arginfo;
    char *usage;
    int has_arg;
    int val;
    spank_opt_cb_f cb;
};
extern int spank_getenv(spank_t spank, const char *var, char *buf, int len);

const char plugin_name[] = "auto_resume_stub";
const char plugin_type[] = "spank";
const unsigned int plugin_version = SLURM_VERSION_NUMBER; /* -D from `slurmd -V` */
const unsigned int spank_plugin_version = 1;

static char auto_resume[32] = "";

static int remember(int val, const char *optarg, int remote) {
    (void)val;
    (void)remote;
    if (optarg == NULL || strlen(optarg) >= sizeof(auto_resume)) return -1;
    strcpy(auto_resume, optarg);
    return 0;
}

struct spank_option spank_options[] = {
    {"auto-resume", "N", "test stub of HyperPod's auto-resume", 1, 0, remember},
    {NULL, NULL, NULL, 0, 0, NULL},
};

int slurm_spank_task_init(spank_t sp, int ac, char **av) {
    char job[64] = "?";
    FILE *record;
    if (auto_resume[0] == '\0' || ac < 1) return 0;
    spank_getenv(sp, "SLURM_JOB_ID", job, sizeof(job));
    record = fopen(av[0], "a");
    if (record == NULL) return -1;
    fprintf(record, "%s auto-resume=%s\n", job, auto_resume);
    fclose(record);
    return 0;
}

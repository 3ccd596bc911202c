/* The part of Slurm's <slurm/spank.h> (Slurm 22.05-25.x, SchedMD/slurm slurm/spank.h) the
 * pyxis stand-in uses, written out so no -dev package is needed: the plugin identification
 * macro, the option table, its terminator. SLURM_VERSION_NUMBER comes from
 * <slurm/slurm_version.h>, as in Slurm's own header. */
#ifndef STANDIN_SPANK_H
#define STANDIN_SPANK_H
#include <stddef.h>
#include <slurm/slurm_version.h>

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
#define SPANK_OPTIONS_TABLE_END { NULL, NULL, NULL, 0, 0, NULL }
#define SPANK_PLUGIN(__name, __ver) \
    const char plugin_name[] = #__name; \
    const char plugin_type[] = "spank"; \
    const unsigned int plugin_version = SLURM_VERSION_NUMBER; \
    const unsigned int spank_plugin_version = __ver;
#endif

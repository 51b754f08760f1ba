#include "expert_pack.h"

extern "C" const char * expert_pack_version(void) {
    return "0.1.0";
}

// Moved to questkv/config.h; this forward goes once every includer names it.
#pragma once
#include "questkv/config.h"
